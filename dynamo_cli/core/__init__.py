"""The request core: one request's stream across workers (hold, prefill, open, migrate) and the pool it draws
on, for the frontend and `dyn router`."""
