"""The engine's vocabulary, shared by both sides of the wall: the calls and messages, results, placement,
sampling parameters, errors."""
