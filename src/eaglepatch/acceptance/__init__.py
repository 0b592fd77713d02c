"""Acceptance, end to end (issue 22): a draft trained on what this project extracts is served at
the accept length its training predicts, and a layer mismatch is caught before it costs that.
``pipeline.Run`` is the run; ``language`` the synthetic target languages and measures; ``train``
the torch side (target, SpecForge draft). docs/acceptance.md describes the method."""
