"""Helpers shared by the test modules: tiny pairs, invariant checks, the scorecard."""
