"""Release: data and model licenses as data, and publishing the drafter."""
