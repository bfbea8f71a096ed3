"""placeholder; replaced by the SGLang double."""
