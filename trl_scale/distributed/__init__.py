"""Distributed backends (optional: `pip install trl-scale[ray]`): Ray role groups for the critic, reward and
reference models (`ray_backend`, `role_workers`, `roles`), owned by the main trainer process for every rank
(`main_process`)."""
