"""Sans-IO wire layer: frame layout, serialization and keys. No sockets, no threads here."""
