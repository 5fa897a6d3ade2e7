"""Offline smoke datasets."""
