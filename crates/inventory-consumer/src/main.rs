#[tokio::main]
async fn main() -> anyhow::Result<()> {
    consumer_runtime::main::<inventory_consumer::Inventory>().await
}
