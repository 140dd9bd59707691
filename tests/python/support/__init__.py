"""Shared test code: builders, assertions, multi-process harness and case tables (not tests)."""
