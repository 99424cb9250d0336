"""Celery workers, runtimes and the investigate command."""
