"""The course kit: the exercises (registry.py), the handout generator (handout.py), the autograder (grade.py)
and, for instructors only (handouts leave it out), the impostor search (impostors.py: no function anywhere in a
handout passes an exercise it blanks). EXERCISES.md is the students' text; README.md's "For instructors" says how
to use the kit."""
