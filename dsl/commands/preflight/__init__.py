"""The commands before launch, none of which imports torch: check, show, explain, plan."""
