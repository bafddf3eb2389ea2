"""Helpers the tests share: real services, clusters, images, workspaces and small training runs."""
