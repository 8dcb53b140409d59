"""Helpers for running parity on specific trainers. Imported only by the trainer's job (for
example torchtitan's ``--module parity.integrations.torchtitan``), never by parity itself."""
