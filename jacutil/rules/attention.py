"""Placeholder: filled in by issue 56."""
