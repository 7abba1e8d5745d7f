#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() -> anyhow::Result<()> {
    consumer_runtime::main::<inventory_consumer::Inventory>().await
}
