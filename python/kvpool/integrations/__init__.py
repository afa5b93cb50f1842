"""Optional integrations; each module imports its third-party library itself, so importing
kvpool never imports torch or transformers."""
