"""The build stage: arch resolution, the build plan, compile units, cache, wheels."""
