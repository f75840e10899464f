"""Slots: the conversation model, its registry, residency on engine sequences, fair admission, slot actions,
persistence in the store, leases and background upkeep.
"""
