"""Optional accelerator back ends, each imported in exactly one module here."""
