"""The event log and everything that reads or writes PostgreSQL."""
