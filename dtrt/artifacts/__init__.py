"""Artifacts on disk (DESIGN.md section 6): export and engine directories, their manifests, the sha256 of every
file, and the write-to-temp-then-rename directory both producers use. The runtime reads artifacts through this
package and never writes them."""
