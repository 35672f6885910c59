"""Model architectures, written once in plain torch against the platform seams."""
