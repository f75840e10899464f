"""HTTP plumbing shared by every API surface: errors, auth, origins, request bodies and read limits, SSE framing,
digests, log filtering.
"""
