"""Reading a published index from the outside: fetching its pages, verifying it as pip and uv see it,
serving a store, public URLs."""
