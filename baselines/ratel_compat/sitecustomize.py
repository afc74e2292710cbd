"""Run by `site` at the start of every Python process whose path has this directory (Ratel's, only)."""
import ratel_patches

ratel_patches.install()
