"""Store layer: the error every reader of stored bytes raises for an entry it cannot trust."""


class CorruptEntryError(ValueError):
    """A stored entry cannot be trusted; the message says why."""
