"""e2m1 rounding, as data: the midpoints between the format's magnitudes (0, 0.5, 1, 1.5, 2, 3,
4, 6) and which way a tie goes (to the even code). The code of |x| is the number of midpoints
below it: x > m for a midpoint a tie stays below (TIE_DOWN), x >= m for one a tie rounds up from
(TIE_UP); saturating at 6. The torch quantizer (checkpoint.e2m1_codes) and the kernels' PTX
(hopper.ptx.quantize_block_text) both count these."""

# (midpoint, a tie rounds up)
MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
TIE_DOWN = tuple(midpoint for midpoint, tie_up in MIDPOINTS if not tie_up)
TIE_UP = tuple(midpoint for midpoint, tie_up in MIDPOINTS if tie_up)
