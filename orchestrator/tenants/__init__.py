"""Tenants: who a request acts for (the principal its key or gateway header names), and what a tenant may use."""
