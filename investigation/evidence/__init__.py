"""EvidenceStore: normalisation, fingerprints, novelty."""

from investigation.evidence.store import EvidenceStore, fingerprint

__all__ = ["EvidenceStore", "fingerprint"]
