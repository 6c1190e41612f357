"""Distributed backends: Ray role groups for the critic and reward models (optional: `pip install trl-scale[ray]`)."""
