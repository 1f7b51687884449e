"""What is found on a host before anything acts: the state probe's answer parsed once into
`hostagent.facts` records (state), the one read a deploy makes (survey), and the doctor's checks of it."""
