"""Test helpers for ff and its plugin authors: synthetic datasets and tiny-component factories."""
