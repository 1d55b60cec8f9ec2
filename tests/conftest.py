import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TESTS))   # the project root: engine, kernels, server, clients
sys.path.insert(0, TESTS)                    # shared test helpers (hf_reference, dist_harness)
