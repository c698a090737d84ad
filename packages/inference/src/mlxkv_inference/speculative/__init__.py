"""speculative: drafts (prompt lookup, a draft model), the adaptive draft length and the rounds that verify them."""
