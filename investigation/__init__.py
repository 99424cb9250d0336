"""The investigation engine's domain library (no Celery, kombu or Redis here)."""
