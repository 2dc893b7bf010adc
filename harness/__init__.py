"""moe-subst harness: build-aware runners, parsers, statistics and reports for the expert cache."""

__version__ = "0.1.0"
