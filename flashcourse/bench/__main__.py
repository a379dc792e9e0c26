"""`python -m flashcourse.bench`: 04's kernel beside torch's scaled_dot_product_attention on a CUDA GPU."""

from flashcourse.bench import main

raise SystemExit(main())
