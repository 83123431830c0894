"""Keeping the fleet fed: engines polled, peers and their load notes, NATS sync, warm start."""
