"""What chooses how each round speculates."""
