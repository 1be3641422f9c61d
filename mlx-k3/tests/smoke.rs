use mlx_k3::*;
#[test]
fn smoke() {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    let b = a.matmul(&a).unwrap().add(1.0f32).unwrap();
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![8.0, 11.0, 16.0, 23.0]);
    let e = a.matmul(&Array::from_slice(&[1.0f32, 2.0, 3.0], &[3, 1]).unwrap()).unwrap_err();
    println!("{e}");
    let up = random::normal(&[1000], Dtype::F32, 0.0, 3.0, Some(&random::key(1).unwrap())).unwrap();
    let g = random::normal(&[1000], Dtype::F32, 0.0, 3.0, Some(&random::key(2).unwrap())).unwrap();
    let y = kernels::situ(&up, &g, 1.5, Some(4.0)).unwrap();
    let r = kernels::situ_reference(&up, &g, 1.5, Some(4.0)).unwrap();
    let d = y.subtract(&r).unwrap().abs().unwrap().max_all(false).unwrap().item::<f32>().unwrap();
    println!("situ diff {d} mlx {}", mlx_version());
    let v = Array::from_vec(vec![1i32, 2, 3], &[3]).unwrap();
    println!("{:?}", v.add(1).unwrap().to_vec::<i32>().unwrap());
}
