"""Passes over ir.Graph: each maps a graph to a new graph (or to an analysis)."""
