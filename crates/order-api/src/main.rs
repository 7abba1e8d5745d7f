#[tokio::main]
async fn main() -> anyhow::Result<()> {
    order_api::cli::main().await
}
