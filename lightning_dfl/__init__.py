"""lightning-dfl: decentralized, personalized federated learning with sparse training."""

__version__ = "0.1.0"
