"""A toolkit for testing Kiln and its plugins: tiny random-weight models, a pytest
plugin (fixtures and device markers) and contract suites plugin authors can run."""
