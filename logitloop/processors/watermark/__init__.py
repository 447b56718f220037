"""Watermarks: Kirchenbauer et al.'s green list and SynthID Text as processors, and detectors."""
