"""Runs the domain's moves against a store, one transaction per move."""
