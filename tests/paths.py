"""Where the tests find the checkout: ROOT is the repository's root (the folder holding burstserve/)."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
