"""Runtimes that execute a converted model for verify."""
