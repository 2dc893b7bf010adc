"""Renderers: pure functions from results to rich renderables, markdown text, or (plots) figure files."""
