//! Test helpers shared by the kernel tests: deterministic random data and central
//! finite differences.

/// Deterministic pseudo-random values uniform in [-1, 1) (LCG; reproducible across runs).
pub fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Central finite-difference gradient of a scalar function of `x`, evaluated in f64:
/// `(f(x + h e_i) - f(x - h e_i)) / 2h`. The function receives f64 inputs so that the
/// reference is free of f32 rounding; its truncation error is O(h²).
pub fn fd_grad(x: &[f32], h: f64, f: &mut dyn FnMut(&[f64]) -> f64) -> Vec<f64> {
    let mut xv: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    (0..x.len())
        .map(|i| {
            let orig = xv[i];
            xv[i] = orig + h;
            let fp = f(&xv);
            xv[i] = orig - h;
            let fm = f(&xv);
            xv[i] = orig;
            (fp - fm) / (2.0 * h)
        })
        .collect()
}

/// Asserts `|a - b| <= atol + rtol·|b|` elementwise, with a readable message.
pub fn assert_close(what: &str, a: &[f32], b: &[f64], atol: f64, rtol: f64) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        let d = (x as f64 - y).abs();
        assert!(
            d <= atol + rtol * y.abs(),
            "{what}[{i}]: got {x}, expected {y} (diff {d})"
        );
    }
}
