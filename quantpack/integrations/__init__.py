"""Integrations of quantpack checkpoints with other serving and training frameworks."""
