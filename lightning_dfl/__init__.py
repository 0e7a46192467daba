"""lightning-dfl."""
