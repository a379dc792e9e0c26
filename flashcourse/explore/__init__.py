"""What the notebooks draw and let a learner play with: the tile explorer and the causal block picture
(widgets). They draw the correct recurrence beside the learner's, so the grading jail holds none of it."""
