//! `mlx-k3 dist-check`: a collective smoke test for a distributed set-up.

use clap::Args as ClapArgs;

use mlx_k3::distributed::{Backend, Group};
use mlx_k3::{Array, Error, Result};

/// Options of `dist-check`.
#[derive(ClapArgs, Debug)]
pub(super) struct Args {
    /// Back-end: any, ring, jaccl, nccl or mpi.
    #[arg(long, default_value = "any")]
    backend: String,
    /// Elements per rank in the test arrays.
    #[arg(long, default_value_t = 1024)]
    elements: i32,
}

pub(super) fn run(args: Args) -> Result<()> {
    let backend = Backend::from_name(&args.backend)
        .ok_or_else(|| Error::invalid("dist-check", format!("unknown back-end '{}'", args.backend)))?;
    let group = Group::init(backend, true)?;
    let (rank, size) = (group.rank(), group.size());
    let n = args.elements.max(1);
    // Rank r contributes x_i = (r + 1) * (i + 1); the sum over ranks is (i + 1) * size (size + 1) / 2.
    let x: Vec<f32> = (0..n).map(|i| ((rank + 1) * (i + 1)) as f32).collect();
    let summed = group.all_sum(&Array::from_slice(&x, &[n])?)?.to_vec::<f32>()?;
    let factor = (size * (size + 1) / 2) as f32;
    let bad_sum = (0..n as usize).find(|&i| summed[i] != (i as f32 + 1.0) * factor);
    let gathered = group.all_gather(&Array::from_slice(&[rank], &[1])?)?.to_vec::<i32>()?;
    let bad_gather = gathered != (0..size).collect::<Vec<i32>>();
    if let Some(i) = bad_sum {
        return Err(Error::invalid(
            "dist-check",
            format!("rank {rank}/{size}: all_sum[{i}] = {} but expected {}", summed[i], (i as f32 + 1.0) * factor),
        ));
    }
    if bad_gather {
        return Err(Error::invalid("dist-check", format!("rank {rank}/{size}: all_gather gave {gathered:?}")));
    }
    println!("rank {rank}/{size}: all_sum and all_gather ok ({n} elements, back-end {})", backend.name());
    Ok(())
}
