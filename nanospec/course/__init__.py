"""The course kit: the exercises (registry.py), the handout generator (handout.py) and the autograder
(grade.py). EXERCISES.md is the students' text; README.md's "For instructors" says how to use the kit."""
